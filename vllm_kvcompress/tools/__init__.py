"""Offline tools: model conversion and (later) profiling and weight export."""
