"""The built-in concurrency autoscaler: a pure decision function (``algorithm``) and its daemon."""
