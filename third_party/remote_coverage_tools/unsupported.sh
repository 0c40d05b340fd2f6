#!/bin/sh
echo "bazel coverage is not supported offline (third_party/remote_coverage_tools)" >&2
exit 1
