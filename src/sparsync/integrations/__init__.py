"""sparsync inside other training frameworks, each behind its optional extra: ``sparsync.integrations.lightning``
(``pip install -e '.[lightning]'``: ``SparsyncStrategy`` for PyTorch Lightning's ``Trainer``). Hugging Face
Accelerate needs no module: docs/integrations.md gives the recipe. ``import sparsync`` imports none of them."""
