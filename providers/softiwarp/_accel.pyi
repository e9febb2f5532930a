# The cffi API-mode module accel_build.py builds (see _accel.h for what lib holds).
from typing import Any

ffi: Any
lib: Any
