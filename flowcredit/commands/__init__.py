"""The ``flowcredit`` commands: thin argument parsing over the library (``flowcredit.cli`` dispatches)."""
