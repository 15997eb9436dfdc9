"""flowcredit: GRPO fine-tuning of flow-matching text-to-image models with step-level credit assignment.

The math core lives in small torch-only modules: ``schedule``, ``sde``, ``values``, ``advantages``,
``calibration`` and ``losses``. Importing the package imports nothing heavy.
"""

__version__ = "0.1.0"
