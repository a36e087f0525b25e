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
def query(
    table: int,
    rows: int,
    c: int,
    ab: int,
    mode: int,
    keys: int,
    start: int,
    width: int,
    out: int,
    k: int,
    is_double: int,
    /,
) -> None: ...
def insert_blocks(
    table: int, rows: int, c: int, ab: int, blocks: int, m: int, b: int, vals: int, is_double: int, /
) -> None: ...
def query_blocks(
    table: int, rows: int, c: int, ab: int, blocks: int, m: int, b: int, out: int, is_double: int, /
) -> None: ...
