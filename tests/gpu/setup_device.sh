#!/usr/bin/env bash
# On the H200 machine: install the carried wheels and the trimmed Ray into /tmp/pylib, with a `ray` CLI.
#   source tests/gpu/setup_device.sh [DIR]      (DIR: the carried directory, default .gpuwheels)
dir=${1:-.gpuwheels}
mkdir -p /tmp/pylib/bin
python3 -m pip install -q --no-deps --target /tmp/pylib "$dir"/*.whl
tar -xJf "$dir/ray-trim.tar.xz" -C /tmp/pylib
printf '#!/usr/bin/env python3\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n' > /tmp/pylib/bin/ray
chmod +x /tmp/pylib/bin/ray
export PYTHONPATH=/tmp/pylib:$PWD PATH=/tmp/pylib/bin:$PATH
