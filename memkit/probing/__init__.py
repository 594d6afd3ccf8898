"""Find the largest batch size that fits: search strategy, trial runner, results, decorator.

``memkit.probe`` (the function) lives in :mod:`memkit.probing.runner`; this package keeps one
module per concern (search, step, state, accumulate, result, decorator).
"""
