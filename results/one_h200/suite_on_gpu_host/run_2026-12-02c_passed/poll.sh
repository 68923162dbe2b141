# Copy what the steps have so far to $OUT every 10 s, until LIMIT seconds or UNTIL exists.
LIMIT=${1:-530}; UNTIL=${2:-/tmp/g/chain.done}
snap() { cp /tmp/g/suite.log $OUT/ 2>/dev/null; (cd /tmp/g && find . -type f -size -12M ! -name suite.log | tar czf $OUT/g.tgz -T - 2>/dev/null); }
while [ $SECONDS -lt $LIMIT ] && [ ! -e $UNTIL ]; do snap; sleep 10; done; snap
tail -4 /tmp/g/suite.log; cat /tmp/g/suite.rc /tmp/g/chain.log 2>/dev/null; ls /tmp/g /tmp/g/gain 2>/dev/null | tr '\n' ' '
