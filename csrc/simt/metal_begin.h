// Opens a region where a Metal kernel body compiles as C++ (see simt_metal.h). Pair with simt/metal_end.h, and
// include nothing else in between: `thread` and `device` would break any C++ header.
#define device
#define constant
#define thread
#define threadgroup static
using namespace metal;
