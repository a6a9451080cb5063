"""The reaper: finds dead workers, stuck tasks, ghost queues and duplicate consumers, and moves
the work on (a new attempt on another worker) or fails it saying why.

``view``, ``detectors`` and ``decisions`` are pure; ``feeds`` (the view kept up to date),
``handling`` (findings acted on), ``actions`` (the writes) and ``service`` do the I/O.
"""
