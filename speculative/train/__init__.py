"""Training: the bundled target LM, target-regenerated data and DFlash drafts.

CLI: ``dflash-train`` (``speculative.train.cli``)."""
