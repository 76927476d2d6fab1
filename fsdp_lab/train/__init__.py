"""One rank's run in named steps, the loop, the optimizer, the loss, and the preemption protocol.
Imports the packages above.
"""
