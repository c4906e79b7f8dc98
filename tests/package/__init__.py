"""The whole product: the wheel, generated code, the public API, the examples."""
