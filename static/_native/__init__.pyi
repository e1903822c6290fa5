# Hand-written stubs for the extension module built from crates/python (crate static-native),
# one per submodule as the Rust is laid out (crates/python/src/<name>.rs): mls (the MLS engine),
# client (the SDK's native client), relay (the relay server), bench (benchmark figures).
#
# Every method releases the GIL and is safe to call from several threads at once. Failures raise
# the classes of static._errors: MLSEngineError ("MLS engine error: ..."), InvalidChannelNameError
# ("invalid channel name: ..."), InternalError ("runtime error: ..."); all subclass RuntimeError.

__version__: str

# Registered with atexit on import: from then on, threads coming back from a blocking call park
# instead of taking the GIL during finalization (which would abort the process on 3.11-3.13).
def _at_exit() -> None: ...
