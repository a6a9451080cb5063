"""The reaper: finds dead workers, stuck tasks, ghost queues and duplicate consumers, and moves
the work on (a new attempt on another worker) or fails it saying why.

``view`` and ``detectors`` and ``decisions`` are pure; ``actions`` and ``service`` do the I/O.
"""
