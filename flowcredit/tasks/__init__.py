"""Built-in benchmark tasks. ``shapes``: ShapeEval, a GenEval-like compositional benchmark."""
