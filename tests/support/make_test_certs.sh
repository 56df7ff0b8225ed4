#!/usr/bin/env bash
# Makes the certificates of the TLS tests in DIR with openssl: a CA and, signed by it, a server
# certificate for 127.0.0.1 and localhost, a client certificate, an expired client certificate;
# and an unrelated CA with a server and a client certificate of its own. Every key is unencrypted.
#   ca.pem ca.key server.pem server.key client.pem client.key expired-client.pem expired-client.key
#   other-ca.pem other-ca.key other-server.pem other-server.key other-client.pem other-client.key
set -euo pipefail
dir=${1:?usage: make_test_certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
export OPENSSL_CONF=/dev/null  # no configuration of the machine's own

ca() {  # NAME SUBJECT
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.pem" -days 30 -subj "$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

# NAME CA SUBJECT EXTENSIONS [START END]: a key and a certificate signed by CA (valid 30 days from
# now, or from START to END, as YYYYMMDDHHMMSSZ).
leaf() {
  local name=$1 ca=$2 subject=$3 ext=$4 start=${5:-} end=${6:-}
  openssl req -new -newkey rsa:2048 -nodes -keyout "$name.key" -out "$name.csr" -subj "$subject" 2>/dev/null
  printf '%s\n' "$ext" > "$name.ext"
  if [[ -z "$start" ]]; then
    openssl x509 -req -in "$name.csr" -CA "$ca.pem" -CAkey "$ca.key" -CAcreateserial -days 30 \
      -extfile "$name.ext" -out "$name.pem" 2>/dev/null
  else
    # openssl x509 takes no start date: a one-certificate `openssl ca` does.
    mkdir -p "$name.db"
    : > "$name.db/index.txt"
    echo 1000 > "$name.db/serial"
    cat > "$name.cnf" <<CNF
[ca]
default_ca = one
[one]
database = $name.db/index.txt
serial = $name.db/serial
new_certs_dir = $name.db
default_md = sha256
policy = any
copy_extensions = none
[any]
commonName = supplied
CNF
    openssl ca -batch -config "$name.cnf" -cert "$ca.pem" -keyfile "$ca.key" -in "$name.csr" \
      -startdate "$start" -enddate "$end" -extfile "$name.ext" -out "$name.pem" -notext 2>/dev/null
    rm -rf "$name.db" "$name.cnf"
  fi
  rm -f "$name.csr" "$name.ext"
}

server_ext="subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
client_ext="extendedKeyUsage=clientAuth"

ca ca "/CN=gradwatch test CA"
leaf server ca "/CN=gradwatchd" "$server_ext"
leaf client ca "/CN=trainer" "$client_ext"
leaf expired-client ca "/CN=expired trainer" "$client_ext" 20200101000000Z 20200102000000Z
ca other-ca "/CN=someone else's CA"
leaf other-server other-ca "/CN=gradwatchd" "$server_ext"
leaf other-client other-ca "/CN=trainer" "$client_ext"
rm -f ./*.srl
