"""What a run leaves behind and how it is read: ``report`` (``report.md`` and the plots), ``checkpoint`` (safetensors
and JSON, for resuming) and ``derived_metrics`` (metrics computed from other metrics, such as ``hm``).

Nothing is imported here: ``derived_metrics`` is read on the actors, and ``report`` loads matplotlib.
"""
