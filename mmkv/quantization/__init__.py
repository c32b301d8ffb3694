"""Weight-only quantization: int8 and int4 layouts (``formats``), the layers that run them
(``linear``) and quantizing a model while it loads (``loading``). docs/quantization.md says what
each costs in accuracy and gains in speed and memory."""

from mmkv.quantization.formats import (METHODS, Int4Weight, Int8GroupWeight, Int8Weight, Quantization,
                                       QuantizedWeight, concatenable, concatenate, quantize)
from mmkv.quantization.linear import QuantizedLinear, QuantizedLinearModule

__all__ = ["METHODS", "Int4Weight", "Int8GroupWeight", "Int8Weight", "Quantization", "QuantizedLinear",
           "QuantizedLinearModule", "QuantizedWeight", "concatenable", "concatenate", "quantize"]
