"""Platform-specific implementations behind one function per operation, chosen by platform
and config; the reference maths in tfm.nn is their specification."""
