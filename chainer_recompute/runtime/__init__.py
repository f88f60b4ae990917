"""The Chainer runtime: graph capture (a ``chainer.FunctionHook``), the
backward driver that drops and regenerates arrays, ``apply()`` and the
memory meters. Every module here imports Chainer through ``_chainer``,
which applies the NumPy compatibility layer first."""
