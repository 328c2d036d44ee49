import os
import sys

# The ranks are spawned processes that import the test modules by name from here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
