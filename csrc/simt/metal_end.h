// Closes the region opened by simt/metal_begin.h.
#undef device
#undef constant
#undef thread
#undef threadgroup
