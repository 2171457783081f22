# The image a fleet can run (fleet.yaml `image:`): harvest in a venv, entry point `harvest`.
#   make image                        # CPU variant, from a local wheelhouse (offline build)
#   make image VARIANT=tpu BASE_IMAGE=python:3.11-slim
# Build args: BASE_IMAGE (any Debian-like image with python3 >= 3.10 and venv), VARIANT cpu | tpu | cuda.
# With wheels in the context's wheelhouse/ it installs from them only (--no-index); else from PyPI.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG VARIANT=cpu
COPY wheelhouse/ /tmp/wheelhouse/
RUN set -eu; \
    case "$VARIANT" in \
      cpu) extras=gcs,s3 ;; tpu) extras=tpu,gcs,s3 ;; cuda) extras=cuda,gcs,s3 ;; \
      *) echo "VARIANT must be cpu, tpu or cuda, got $VARIANT" >&2; exit 2 ;; \
    esac; \
    python3 -m venv /opt/harvest; \
    if ls /tmp/wheelhouse/harvest-*.whl >/dev/null 2>&1; then \
      /opt/harvest/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheelhouse "harvest[$extras]"; \
    else \
      /opt/harvest/bin/pip install --no-cache-dir "harvest[$extras]"; \
    fi; \
    rm -rf /tmp/wheelhouse
ENV PATH=/opt/harvest/bin:$PATH HARVEST_CACHE=/var/cache/harvest
ENTRYPOINT ["harvest"]
CMD ["--help"]
