"""Offline developer tools (not part of the installed ``fxopt`` package)."""
