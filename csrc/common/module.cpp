// The Python module object of flashllm_ext._C. Its only job is to be importable: importing it runs the static
// TORCH_LIBRARY_IMPL registrations of every kernel linked into the library.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "flashllm_ext native kernels", -1, nullptr};
  return PyModule_Create(&module);
}
