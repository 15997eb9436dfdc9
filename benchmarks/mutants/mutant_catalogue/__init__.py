"""The mutants of ``benchmarks/mutants/mutants.py`` (issue 28): each one semantic bug, written as an
exact edit of one line of ``flowcredit/``, with the tests that should catch it. The runner is ``mutants.py``
beside this folder; the mutants are declared by area: ``glue.py`` (the training loop's glue and what
surrounds it, issue 28), ``newer_methods.py`` (the newer methods' loop glue, issue 39) and
``outside_check.py`` (five behaviours an outside mutation check found, issue 54), ``flow_dppo.py``
(Flow-DPPO's update rule, issue 60), ``coca.py`` (CoCA's credit rule and its plumbing, issue 60),
``flash_grpo.py`` (Flash-GRPO's weights and per-group plan, issue 60) and ``tree_grpo.py`` (tree
rollouts and TreeGRPO's edge values, issue 60), ``dgpo.py`` (DGPO's group weights and noise, issue 60),
``g2rpo.py`` (G²RPO's completion grids and integration, issue 60);
:class:`Mutant` is in ``mutant.py``.
"""

from __future__ import annotations

from .coca import MUTANTS as COCA
from .dgpo import MUTANTS as DGPO
from .flash_grpo import MUTANTS as FLASH_GRPO
from .flow_dppo import MUTANTS as FLOW_DPPO
from .g2rpo import MUTANTS as G2RPO
from .glue import MUTANTS as GLUE
from .mutant import Mutant
from .newer_methods import MUTANTS as NEWER_METHODS
from .outside_check import MUTANTS as OUTSIDE_CHECK
from .tree_grpo import MUTANTS as TREE_GRPO

__all__ = ["MUTANTS", "Mutant"]

MUTANTS: list[Mutant] = [
    *GLUE,
    *NEWER_METHODS,
    *OUTSIDE_CHECK,
    *FLOW_DPPO,
    *COCA,
    *FLASH_GRPO,
    *TREE_GRPO,
    *DGPO,
    *G2RPO,
]
"""Every mutant, in the order of the report."""
