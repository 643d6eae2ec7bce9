// The decode step's AVX-512 pieces for paged K/V (through a block table), and those scoring on
// AVX512_BF16's vdpbf16ps, in a unit of their own so that they compile in parallel with the
// contiguous ones (see decode.cpp, which this unit compiles with QKV_DECODE_UNIT and
// QKV_DECODE_PAGED set).
#define QKV_DECODE_UNIT 3
#define QKV_DECODE_PAGED 1
#include "decode.cpp"
