"""GenEval (Ghosh et al. 2023): its rules (``rules``), metadata (``metadata``), detectors and the ``geneval`` reward."""
