"""The `speculative_decoding` evaluate metric (the script in this folder; see its docstring)."""
