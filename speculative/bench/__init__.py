"""``dflash-bench``: paper-style benchmark of DFlash against plain decoding and
peers (transformers assisted generation, prompt-lookup decoding)."""
