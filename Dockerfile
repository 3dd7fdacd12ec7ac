# The Castor root service (and the `castor` CLI, agents included).
FROM python:3.11-slim-bookworm
WORKDIR /opt/castor
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# CPU build of torch: the control plane and the agents never touch a GPU themselves.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml setup.py constraints.txt README.md ./
COPY services ./services
COPY worker_lib ./worker_lib
COPY migrations ./migrations
# A regular (not editable) install: the wheel carries the migrations. The versions CI proved.
RUN pip install -c constraints.txt ".[server,s3]"
EXPOSE 8080
CMD ["castor", "serve", "--host", "0.0.0.0", "--port", "8080"]
