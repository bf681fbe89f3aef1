@0xdaf6b9f36ec2562d;
# The limit of bench/api.py: a raw Cap'n Proto echo, no feosd in between.
interface Echo {
  echo @0 (id :Text) -> (id :Text);
}
