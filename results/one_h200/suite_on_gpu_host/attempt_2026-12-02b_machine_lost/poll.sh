# Copy what the steps have so far to $OUT every 10 s, until LIMIT seconds or the chain is done.
LIMIT=${1:-560}
snap() { cp /tmp/g/suite.log $OUT/ 2>/dev/null; (cd /tmp/g && find . -type f -size -12M ! -name suite.log | tar czf $OUT/g.tgz -T - 2>/dev/null); }
while [ $SECONDS -lt $LIMIT ] && [ ! -e /tmp/g/chain.done ]; do snap; sleep 10; done; snap
tail -3 /tmp/g/suite.log; cat /tmp/g/chain.log; ls /tmp/g /tmp/g/gain 2>/dev/null | tr '\n' ' '
