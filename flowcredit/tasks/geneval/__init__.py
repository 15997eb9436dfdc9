"""GenEval (Ghosh et al. 2023): its rules, metadata, detectors and the ``geneval`` reward."""
