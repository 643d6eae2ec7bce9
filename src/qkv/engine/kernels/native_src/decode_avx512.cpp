// The decode step's AVX-512 pieces for contiguous K/V, and those scoring on AVX512_BF16's
// vdpbf16ps, in a unit of their own so that the clones compile in parallel (see decode.cpp,
// which this unit compiles with QKV_DECODE_UNIT set).
#define QKV_DECODE_UNIT 3
#include "decode.cpp"
