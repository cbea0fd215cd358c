// Drives files.watchDir through the unchanged SDK: the events of files
// written by files.write and by a command, a file removed, in the watched
// directory and (recursive) below it. The Go test (e2b's TestWatchDirSDK)
// checks what it prints: one JSON line per step.
import { Sandbox } from 'e2b'

const out = (step, v) => console.log(JSON.stringify({ step, ...v }))
const sbx = await Sandbox.create(process.env.MOAT_TEMPLATE || 'base')
await sbx.files.write('/home/user/w/old.txt', 'there before')

const seen = []
let exited = 'no'
const handle = await sbx.files.watchDir('/home/user/w', (e) => seen.push(e.type + ' ' + e.name), {
  recursive: true,
  onExit: (err) => { exited = err ? err.name : 'clean' },
})
await sbx.files.write('/home/user/w/new.txt', 'new')
await sbx.commands.run('mkdir -p w/sub && echo made > w/sub/by-bash.txt && rm w/old.txt && echo outside > elsewhere.txt')
const want = ['create new.txt', 'create sub', 'create sub/by-bash.txt', 'remove old.txt']
for (let i = 0; i < 100 && !want.every((w) => seen.includes(w)); i++) {
  await new Promise((resolve) => setTimeout(resolve, 100))
}
await handle.stop()
out('events', { want: want.filter((w) => seen.includes(w)), outside: seen.filter((s) => s.includes('elsewhere')) })

let missing
try {
  await sbx.files.watchDir('/home/user/nope', () => {})
  missing = 'watched'
} catch (e) {
  missing = e.name
}
out('missing', { error: missing })
out('kill', { killed: await sbx.kill() })
process.exit(0)
