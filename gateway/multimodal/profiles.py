"""The built-in model profiles, in lookup order.  A new model adds one line here."""

from . import m3, qwen2_vl
from .spec import register_profile

register_profile(m3.MODEL_TYPE, m3.profile)
register_profile(qwen2_vl.MODEL_TYPE, qwen2_vl.profile)
