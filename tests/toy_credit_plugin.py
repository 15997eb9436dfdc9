"""A user's module that registers a credit method on import (``--imports toy_credit_plugin``)."""

from flowcredit.advantages import ADVANTAGES, register_credit


def halved_terminal(values, group, trained, *, eps, adv_clip, scale=0.5):
    """Flow-GRPO's advantages times ``scale``."""
    return ADVANTAGES["flow_grpo"](values, group, trained, eps=eps, adv_clip=adv_clip) * scale


register_credit("halved_terminal", halved_terminal, needs="final", options={"scale": 0.5})
