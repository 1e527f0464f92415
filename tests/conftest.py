import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))   # lets tests import the shared `tiny` helpers
torch.set_num_threads(min(2, torch.get_num_threads()))
