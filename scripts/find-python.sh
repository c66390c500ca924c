#!/bin/sh
# Prints the path of a Python interpreter on PATH that is at least version $1 (e.g. 3.11), and says on stderr
# which one it took. Tried in order: python3, then python3.N from the newest N down. Exit 1 when none fits.
set -eu

minimum=${1:-3.11}
major=${minimum%%.*}
minor=${minimum#*.}

new_enough() {
    "$1" -c "import sys; sys.exit(sys.version_info[:2] < ($major, $minor))" 2>/dev/null
}

tried=""
for name in python3 python3.14 python3.13 python3.12 python3.11 python3.10; do
    path=$(command -v "$name" 2>/dev/null) || continue
    if new_enough "$path"; then
        version=$("$path" -c "import platform; print(platform.python_version())")
        echo "Using $path (Python $version); PYTHON=... picks another" >&2
        echo "$path"
        exit 0
    fi
    tried="$tried $path"
done
echo "No Python >= $minimum found on PATH (tried:${tried:- nothing}); install one, or give PYTHON=/path/to/python" >&2
exit 1
