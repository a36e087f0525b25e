# The C extension's signatures (_qsgd_c.c): pointers are tensor.data_ptr() ints.

def encode(
    x: int, k: int, bucket: int, bits: int, seed: int, scales: int, codes: int, scratch: int, /
) -> None: ...
def decode_sum(
    codes: list[int], scales: list[int], first: int, k: int, bucket: int, bits: int, out: int, /
) -> None: ...
