"""The kernel registry: which implementation serves each (page format, operation, device)."""
