"""The Hugging Face ``custom_generate`` hook, as a real module of the package.

``generate.py`` is the one place where the window rule is written down (``window_confidence`` and
``keep_drafting``): ``ppow_trl.core.windowing`` imports it, and ``ppow_trl.serving.assisted.save_assistant`` copies
the file verbatim into a drafter folder as ``custom_generate/generate.py`` (it needs only torch and
transformers there).
"""
