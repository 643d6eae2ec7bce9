// The decode step's baseline pieces for paged K/V (through a block table), in a unit of their
// own so that they compile in parallel with the contiguous ones (see decode.cpp, which this
// unit compiles with QKV_DECODE_PAGED set).
#define QKV_DECODE_UNIT 0
#define QKV_DECODE_PAGED 1
#include "decode.cpp"
