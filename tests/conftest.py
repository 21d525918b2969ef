import sys
from pathlib import Path

# Test modules import shared helpers from each other (e.g. make_weight).
sys.path.insert(0, str(Path(__file__).parent))
