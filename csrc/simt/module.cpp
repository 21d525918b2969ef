// The Python module object of flashllm_ext._simt (tests only). Importing it runs the static TORCH_LIBRARY
// registrations of the `flashllm_simt` ops.
#include <Python.h>

PyMODINIT_FUNC PyInit__simt(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_simt",
                                      "flashllm_ext GPU kernel bodies on the CPU SIMT emulation", -1, nullptr};
  return PyModule_Create(&module);
}
