"""The run machinery between the one loop (``flowcredit.train``) and the math core: what a run holds
(``session``), its rollouts and values (``rollout``), ψ calibration (``calibrate``), evaluation
(``evaluation``), outputs (``outputs``), policy/LoRA (``policy``), checkpoints, logs and processes."""
