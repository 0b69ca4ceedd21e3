"""Schedule visualizer: panels of boxes per rank (`layout`), drawn as text, Chrome traces or figures.

Planning code: no torch. matplotlib is imported only by `figure`, when a picture is drawn.
"""
