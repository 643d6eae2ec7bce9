// The decode step's AVX2 pieces for contiguous K/V, in a unit of their own so that the clones
// compile in parallel (see decode.cpp, which this unit compiles with QKV_DECODE_UNIT set).
#define QKV_DECODE_UNIT 2
#include "decode.cpp"
