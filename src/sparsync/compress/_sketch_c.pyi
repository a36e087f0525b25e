# The C extension's signatures (_sketch_c.c): pointers are tensor.data_ptr() ints.

def insert(
    table: int,
    rows: int,
    c: int,
    ab: int,
    mode: int,
    keys: int,
    start: int,
    width: int,
    vals: int,
    k: int,
    is_double: int,
    /,
) -> None: ...

# query(table, rows, c, ab, mode, keys, start, width, out, k, is_double, /): insert's signature, the values
# read out into ``out`` instead of added from ``vals`` (positional-only, so the names do not matter)
query = insert

def insert_blocks(
    table: int, rows: int, c: int, ab: int, blocks: int, m: int, b: int, vals: int, is_double: int, /
) -> None: ...
def query_blocks(
    table: int, rows: int, c: int, ab: int, blocks: int, m: int, b: int, out: int, is_double: int, /
) -> None: ...
