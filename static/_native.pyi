# Hand-written stub for the extension module built from rust_mls/python.
__version__: str
