"""CoVeil edge SDK: private cloud-edge collaborative decoding on the device.

Importing this package is light: numpy only.  llama.cpp and gRPC are imported
when the objects that need them are first used.
"""

__version__ = "0.1.0"
