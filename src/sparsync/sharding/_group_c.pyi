# The C extension's signatures (_group_c.c): pointers are tensor.data_ptr() ints.

def unique(keys: int, n: int, out: int, inverse: int, /) -> int: ...
def gather(src: int, limit: int, row_bytes: int, rows: int, n: int, out: int, /) -> None: ...
def scatter_add(src: int, index: int, n: int, dim: int, out: int, m: int, is_double: int, /) -> None: ...
def sum_rows(rows: int, n: int, values: int, dim: int, out_rows: int, out: int, is_double: int, /) -> int: ...
def update(
    kind: int,
    t: int,
    rows_total: int,
    dim: int,
    rows: int,
    n: int,
    v: int,
    std: int,
    stride: int,
    lr: float,
    is_double: int,
    /,
) -> None: ...
