"""What the tests share: inputs every backend sees, reference computations, tiny models, and the native-library,
memory and fault tools several test modules use."""
